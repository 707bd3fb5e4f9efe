"""The worker side: the agent, the filter-daemon supervisor, the daemon and its engine."""
