"""groundflow envs."""
