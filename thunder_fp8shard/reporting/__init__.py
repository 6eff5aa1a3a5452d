"""How a plan reads: byte formats and tables, and the predicted memory timelines drawn."""
