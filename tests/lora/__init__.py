"""LoRA workload tests (a package, so its test_bad_inputs.py does not clash with tests/test_bad_inputs.py)."""
