"""Pattern families (one module each) and the registry they register into."""
