"""Running batches of prompts through a target and a drafter: static shapes, compiled programs, static
batches, continuous batching and the results they return."""
