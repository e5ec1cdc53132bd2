"""The trainer's callbacks: what runs around the training step (logging window, pictures, periodic eval,
checkpoint interval, the end-of-run export / eval); ``base.py`` holds the protocol."""
