"""Engine replicas behind one OpenAI endpoint on Ray Serve, routed by exact prefix-cache state."""
