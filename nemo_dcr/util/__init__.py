"""Plumbing shared by the layers: worker thread pools and progress bars."""
