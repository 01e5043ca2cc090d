"""Glue for the frameworks that own the training loop: PyTorch Lightning, Hugging Face Transformers'
Trainer and Accelerate (docs/integration.md, a section per framework).

Each integration is its own module and imports its framework lazily: ``import resilient_slurm`` never
imports Lightning, Transformers or Accelerate, and a missing framework is named with the extra to install.
"""
