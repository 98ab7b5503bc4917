"""kvtier sim package."""
