"""Benchmarks: harness, references every bench compares against, and the benches themselves."""
