"""Selection strategies (which problems a step trains on) and budget allocators (how many rollouts each gets)."""
