"""Runners for the peers' own code (nanoGPT speedrun records, crosslayer-coding, goodfire spd), checked out
under the git-ignored ``.peers/``."""
