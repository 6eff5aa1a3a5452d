"""Stage 6, run time: the pass's operators, the payload kinds they move, the first-call checks against the plan and
the report they write (the plan itself stays as compiled), and the program without those checks once they are done."""
