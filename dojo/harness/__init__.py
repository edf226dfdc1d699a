"""The rank harness."""
