"""What every package shares and nothing of ours is imported by: the error family's base."""
