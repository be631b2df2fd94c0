"""The workers of speed/peer_step.py: one training step per trainer, each run in its own
interpreter (a peer's virtualenv), on the same inputs made by case.py."""
