"""The memory model the planner weighs every choice on: the program's storages, the step's other terms, and what the
device's allocator said while compiling."""
