"""The scheduler and its policy, sampling parameters, open sequences, input and output processing."""
