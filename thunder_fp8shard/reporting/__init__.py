"""How a plan reads: its text (``plan_text.py``) and its predicted memory timelines (``plot.py``)."""
