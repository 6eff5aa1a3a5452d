"""Support for the tests, the benchmarks, the demo and the notebook; nothing in the pass imports it."""
