"""The NS (NeuronSpark-style spiking SSM) models."""
