"""Training drafters: data regeneration and hidden-state capture (data.py), datasets (dataset.py),
losses (losses.py), the one trainer loop with checkpoints and DDP (trainer.py), CLI (cli.py)."""
