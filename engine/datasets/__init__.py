"""Importers: outside data turned into SpecLab runs."""
