"""What a state is: dtypes, flat element access, canonical index maps, tensor and state digests."""
