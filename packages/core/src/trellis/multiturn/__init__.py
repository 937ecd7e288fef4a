"""Multi-turn rollouts: the config section, the environment (interactions and tools), the agent loop, scoring."""
