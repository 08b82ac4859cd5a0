"""prorl: prolonged RL (the ProRL v2 recipe) for LLM reasoning, on fused kernels.

Kept light on purpose: `import prorl.kernels` must cost only the kernels (docs/architecture.md), so
nothing here imports the trainer, the engine or the kernels.
"""

__version__ = "0.1.0"
