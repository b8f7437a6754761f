"""groundflow guidance."""
