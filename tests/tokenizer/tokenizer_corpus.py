"""Texts that exercise every branch of the qwen35 pre-tokenizer, shared by the tokenizer tests."""

CORPUS: dict[str, str] = {
    "english": (
        "The quick brown fox jumps over the lazy dog. It wasn't the fox's fault, was it? "
        "Meanwhile, in 1984, a 3.5-inch disk held 1.44 MB; today's drives hold ~20 TB!"
    ),
    "contractions": "DON'T stop, I'M here, they'RE gone, we'LL see, she'D say, it'S ok, you'Ve, I'm, it’s",
    "python": (
        "class Stack:\n"
        '    """A LIFO stack."""\n\n'
        "    def __init__(self) -> None:\n"
        "        self._items: list[int] = []\n\n"
        "    def push(self, x: int) -> None:\n"
        "\tself._items.append(x)  # tab-indented on purpose\n"
        "        if len(self._items) > 0x10:\n"
        "            raise OverflowError(f'{x!r} too many')\n"
    ),
    "javascript": (
        "const fetchAll = async (urls) => {\n"
        "  const res = await Promise.all(urls.map((u) => fetch(u)));\n"
        "  return res.filter(r => r.ok && r.status !== 404);\n"
        "};\n// TODO: retry === true ??  false\n"
    ),
    "chinese": "我们公司的人力资源部门在新加坡。自然语言处理是人工智能的一个重要方向，值得一提的是……",
    "japanese": "吾輩は猫である。名前はまだ無い。カタカナとひらがな、そして漢字を混ぜた文です。",
    "korean": "안녕하세요, 세계! 한국어 토크나이저 테스트입니다.",
    "cyrillic_arabic_thai": (
        " Требуются специалисты; является, являются, документами. بالنسبة إلى الأسبوع المقبل. สัปดาห์หน้า ภาษาไทย"
    ),
    "mixed_scripts_no_spaces": "anjutkan洛杉矶ويب требованиям共和国 人力资源管理coon Процедура人力资源和社会保障",
    "emoji": "I ❤️ 🍕! 👨‍👩‍👧‍👦 family, 👍🏽 thumbs, 🏳️‍🌈 flag, 🇩🇪🇯🇵 flags, 1️⃣ keycap, 🫠",
    "combining_marks": "cafe\u0301 nin\u0303o Zu\u0308rich Vie\u0323\u0302t Nam \u1100\u1161\u11a8 a\u0301\u0301 \u0301x",
    "precomposed": "café niño Zürich Việt Nam 각",
    "digits": "0123456789 3.14159265358979 1,000,000 ١٢٣ １２３ Ⅻ ½ 2²",
    "whitespace": "a  b   c\t\td\n\ne \r\n\r\nf   \n  \n\t \u00a0g\u3000h    ",
    "trailing_spaces": "line one   \nline two\t\t\n   \n",
    "newline_runs": "\n\n\n\r\r\n \n \n  x\n",
    "punctuation": "!!! ??? ... --- ((())) [[]] {{}} <<>> ''' \"\" `` ;; :: ~~ @@ ## $$ %% ^^ && ** __ ++ ==",
    "special_tokens": (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nhmm\n</think>\n\n<tool_call>\n<function=f>\n</function>\n"
        "</tool_call><|im_end|><|endoftext|>"
    ),
    "special_tokens_glued": "a<|im_end|>b <think>x</think>y <<|im_end|>> <|im_end|<|im_end|>|> <|im_end",
}
