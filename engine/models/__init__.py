"""flowrt."""
