"""Thin adapters of the trainer link for the frameworks users train with (Lightning, Hugging Face
Trainer, torchtitan, DeepSpeed); each imports its framework only when used."""
