"""Evaluation, export and plots of finished (or running) runs.

- `python -m dtrain.evaluate eval|export ...` (__main__.py): the torch side, run by the control layer
  as a subprocess or a cluster job, or by a batch script;
- records.py: what an evaluation leaves under a run (no torch);
- curves.py: metrics.jsonl read tolerantly, and the curves drawn as a PNG (no torch);
- mnist.py, lora.py: the evaluations; export.py: ONNX export checked against torch.

Importing this package imports nothing heavy.
"""
