"""zaya_jax.serve.text.ResponseText: stop strings over the incremental text, and one decode per
token shared by the engine's stop predicate and the event loop's `add`."""

from zaya_jax.serve.text import ResponseText


class Letters:
    """A tokenizer stand-in: token i is chr(ord('a') + i); counts its decodes."""

    def __init__(self):
        self.decodes = 0

    def decode(self, tokens):
        self.decodes += 1
        return "".join(chr(ord("a") + t) for t in tokens)


def test_the_stop_predicate_and_add_share_one_decode_per_token():
    tokenizer = Letters()
    text = ResponseText(tokenizer, stop_strings=["de"], stop_ids={25})
    response, sent = [0, 1, 2, 3, 4], ""
    for n in range(1, len(response) + 1):
        stopped = text.stop_matched(response[:n])  # the engine's thread, first
        sent += text.add(response[n - 1])           # then the event loop, from the same decode
        if stopped:
            break
    assert n == 5 and text.stopped and sent + text.finish() == "abc"
    assert tokenizer.decodes == 5  # one per token, not two


def test_a_final_stop_id_is_no_text_and_decodes_nothing():
    tokenizer = Letters()
    text = ResponseText(tokenizer, stop_strings=["z"], stop_ids={25})
    assert not text.stop_matched([0, 25]) and text.add(0) == "a" and text.add(25) == ""
    assert tokenizer.decodes == 1 and text.finish() == ""
