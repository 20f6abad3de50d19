"""A request's images and videos, from bytes to what a vision tower reads: decoding under bounds (`decode`), the
checkpoint's processor and the soft tokens it makes (`images`), and the plan that prepares a job's media off the
engine's thread (`plan`). Below the engine, beside the vocabulary: it imports neither the engine nor the models."""
