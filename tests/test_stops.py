from provider.engine.stops import StopMatcher


def feed_all(m: StopMatcher, pieces):
    out, hit = [], False
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return "".join(out), hit


def test_no_stops_passes_through():
    assert feed_all(StopMatcher(()), ["ab", "cd"]) == ("abcd", False)


def test_stop_split_across_chunks_is_cut():
    assert feed_all(StopMatcher(("END",)), ["hello E", "N", "D tail"]) == ("hello ", True)


def test_held_text_released_when_not_a_stop():
    m = StopMatcher(("END",))
    assert m.feed("abcE") == ("abc", False)  # "E" might start END
    assert m.feed("x") == ("Ex", False)


def test_earliest_of_several_stops_wins():
    assert feed_all(StopMatcher(("zz", "b")), ["a", "bzz"]) == ("a", True)


def test_flush_returns_pending_prefix_at_end():
    assert feed_all(StopMatcher(("END",)), ["fin", "EN"]) == ("finEN", False)
