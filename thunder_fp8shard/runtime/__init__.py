"""Stage 6, run time: the pass's operators, their payloads, and the first-call checks against the plan."""
