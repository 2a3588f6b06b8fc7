"""A tiny offline TFDS dataset with non-prompt column names, standing in for a user's dataset.

It lives in an importable module because TFDS (without TensorFlow) only reads builders
it can find by their registered name.
"""

import tensorflow_datasets as tfds

QUESTIONS = {
    "train": [
        ("What is the capital of France?", "Paris", "geography"),
        ("How many legs does a spider have?", "Eight", "biology"),
        ("What is 12 times 12?", "144", "arithmetic"),
        ("Who wrote 'Pride and Prejudice'?", "Jane Austen", "literature"),
        ("What gas do plants absorb from the air?", "Carbon dioxide", "biology"),
        ("What is the boiling point of water at sea level in Celsius?", "100", "physics"),
        ("Which planet is known as the red planet?", "Mars", "astronomy"),
        ("What is the square root of 81?", "9", "arithmetic"),
    ],
    "test": [
        ("What is the largest ocean on Earth?", "The Pacific", "geography"),
        ("What is 7 plus 15?", "22", "arithmetic"),
    ],
}


class LocalQuestions(tfds.core.GeneratorBasedBuilder):
    """Question/answer pairs; the prompt lives in the `question` column."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def __init__(self, *, file_format="array_record", **kwargs):
        super().__init__(file_format=file_format, **kwargs)

    def _info(self):
        features = {name: tfds.features.Text() for name in ("question", "answer", "topic")}
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features),
                                     disable_shuffling=True)

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(rows) for split, rows in QUESTIONS.items()}

    def _generate_examples(self, rows):
        for index, (question, answer, topic) in enumerate(rows):
            yield index, {"question": question, "answer": answer, "topic": topic}
