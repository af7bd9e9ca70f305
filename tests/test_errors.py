"""memplan's errors (memplan/errors.py)."""

from collections import OrderedDict

from memplan.errors import a_type


def test_a_type_takes_the_article_its_name_is_spoken_with():
    assert [a_type(5), a_type("x"), a_type(OrderedDict()), a_type(None), a_type(1.5)] == [
        "an int",
        "a str",
        "an OrderedDict",
        "a NoneType",
        "a float",
    ]
