"""The round engine: the speculative loop, its streams, slot cells and schedules, and what a round is made of."""
