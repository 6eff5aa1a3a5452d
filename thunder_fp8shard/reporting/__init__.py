"""How a plan reads: its text (``plan_text.py``), byte formats and tables (``format.py``), and the predicted memory
timelines drawn (``plot.py``)."""
