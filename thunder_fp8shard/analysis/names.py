"""The names of Thunder's and TransformerEngine's operators the pass reads in a trace (a stateful TE operator's name
ends in its number, ``get_te_fp8_state_3``)."""

ALL_GATHER = "torch_all_gather_prim_impl"
WAIT = "torch_wait_prim_impl"
REDUCE_SCATTER = "torch_reduce_scatter_prim_impl"
ALL_REDUCE = "torch_all_reduce_prim_impl"
BROADCAST = "torch_broadcast_prim_impl"
COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST)
SLICE = "torch_slice_prim_impl"  # Thunder FSDP's unpad slice of a gathered parameter, and any slice
DIVIDE = "true_divide"  # Thunder FSDP's division of a gradient by the world size
TE_LINEAR_FWD = "te_functional_linear_fwd"
TE_SCALE_UPDATE = "te_fp8_amax_and_scale_update"  # passes its tokens through; all-reduces each state's amax history
TE_QUANTIZERS = "get_te_fp8_quantizers"
TE_STATE = "get_te_fp8_state"
TE_RECIPE = "get_te_fp8_recipe"
