"""What calls the algorithms: the federation builder, the round driver, the in-memory simulator,
gossip, run directories."""
