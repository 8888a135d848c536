"""Helix for PyTorch Lightning and Hugging Face Accelerate (thin; public helix_core API only).

The data module, the deadline callback and the Accelerate plugin land with the data-plane issue.
"""
__all__: list[str] = []
