"""Versions in a store: manifests and HEAD, the joint commit, Publisher, Follower, retention, groups,
and `chunk_gather` (classes chunks decoded together by a receiver group sharded differently)."""
