"""Cleaning: what decides which documents prepare keeps (quality filters, de-duplication, decontamination)."""
