"""autotune: overnight sweeps that find the fastest exact speculative-decoding setup.

The driver (``autotune.sweep``) owns the Optuna study and MLflow; workers measure configs on a
loaded ``engine`` pair and return plain records. Entry point: ``autotune`` (``autotune.cli:main``).
"""

__version__ = "0.1.0"
