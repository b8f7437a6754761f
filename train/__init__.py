"""groundflow train."""
