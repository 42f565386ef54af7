"""Masked diffusion LMs as drafters (DiffuSpec): the protocol they implement, the models and their loaders."""
