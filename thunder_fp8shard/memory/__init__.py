"""The memory model the planner weighs every choice on: the joint program's storages and steps, the terms of the step
besides the program, and what the device's allocator said while compiling."""
