"""The neural side: PersonaPlex LM, streaming Mimi, loading, prompts, sampling, and the batched frame engine."""
