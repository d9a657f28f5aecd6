"""Training the DFlash draft on a target's own outputs (``train``) and its command (``train_cli``)."""
