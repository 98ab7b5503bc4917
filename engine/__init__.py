"""kvtier engine package."""
