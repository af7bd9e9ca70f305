"""Fine-tuning as people set it up: adapters added to the model before the step is traced."""
