"""Versions in a store: manifests and HEAD, the joint commit, Publisher, Follower, retention, groups."""
