"""The fixed certification corpus: >= 300 items, many languages and scripts, code, emoji,
very short and long (past the 256-token truncation limit) inputs.

It is built deterministically from hand-written pieces below (no randomness, no download), so
every run — tests, certification, benchmarks — sees exactly the same items in the same order.
`queries()` / `documents()` split it for retrieval-agreement checks.
"""

from __future__ import annotations

from functools import cache

SENTENCES = [
    # English
    "The cat sits on the warm windowsill and watches the birds.",
    "A kitten is sleeping on a soft rug near the fireplace.",
    "Stock markets fell sharply on Monday after the central bank raised rates.",
    "The quarterly report shows revenue growth of twelve percent.",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "Mitochondria are often called the powerhouse of the cell.",
    "The train to Edinburgh departs from platform nine at half past six.",
    "Please remember to water the tomatoes before you leave for work.",
    "He fixed the bicycle chain with a pair of pliers and some oil.",
    "Quantum computers use qubits that can exist in superposition.",
    "The museum's new exhibition features paintings from the Dutch Golden Age.",
    "Heavy rain is expected across the northern region this weekend.",
    "She ordered a large coffee with oat milk and no sugar.",
    "The recipe calls for two cups of flour and three eggs.",
    "Our flight was delayed by four hours because of fog.",
    "Regular exercise improves both physical and mental health.",
    "The library closes early on public holidays.",
    "Neural networks learn representations from large amounts of data.",
    "The volcano erupted, sending ash high into the atmosphere.",
    "Can you recommend a good book about the history of mathematics?",
    # Accented Latin scripts
    "Le chat dort paisiblement sur le canapé du salon.",
    "Les marchés boursiers ont chuté après l'annonce de la banque centrale.",
    "Où se trouve la gare la plus proche, s'il vous plaît ?",
    "El perro corre feliz por la playa al amanecer.",
    "La economía española creció más de lo esperado este año.",
    "¿Cuánto cuesta un billete de ida y vuelta a Sevilla?",
    "Der Hund schläft unter dem großen Küchentisch.",
    "Die Aktienkurse fielen nach der Zinserhöhung deutlich.",
    "Übermorgen fahren wir mit dem Zug nach München.",
    "O gato está dormindo no sofá da sala.",
    "Il gatto dorme tranquillo sul divano.",
    "Kot śpi spokojnie na parapecie okna.",
    "Kočka spí na teplém radiátoru.",
    "Köpek bahçede top ile oynuyor.",
    "Tôi thích uống cà phê sữa đá vào buổi sáng.",
    "Smörgåsbord är en svensk måltid med många rätter.",
    "Ærøskøbing er en lille by på Ærø.",
    "Þetta er fallegur dagur á Íslandi.",
    # Non-Latin scripts
    "Кошка спит на тёплом подоконнике.",
    "Фондовые рынки резко упали в понедельник.",
    "Η γάτα κοιμάται στον καναπέ.",
    "החתול ישן על אדן החלון.",
    "القطة نائمة على حافة النافذة.",
    "बिल्ली खिड़की पर सो रही है।",
    "বিড়ালটি জানালার ধারে ঘুমাচ্ছে।",
    "பூனை ஜன்னல் ஓரத்தில் தூங்குகிறது.",
    "แมวกำลังนอนหลับอยู่ที่ขอบหน้าต่าง",
    "კატა ფანჯრის რაფაზე სძინავს.",
    "Կատուն քնած է պատուհանի գոգին։",
    # CJK
    "猫は窓辺で静かに眠っています。",
    "株式市場は月曜日に急落しました。",
    "東京駅から新幹線で大阪へ向かいます。",
    "猫在窗台上安静地睡觉。",
    "股市在周一大幅下跌。",
    "我们明天早上八点在图书馆见面。",
    "人工智能正在改变我们的生活方式。",
    "고양이가 창가에서 자고 있습니다.",
    "주식 시장이 월요일에 급락했습니다.",
    "내일 아침에 도서관에서 만나요.",
    # Emoji and symbols
    "I love pizza 🍕 and ice cream 🍦!",
    "Great job team 🎉🎉🎉 see you tomorrow 👋",
    "The forecast: ☀️ in the morning, 🌧️ after lunch.",
    "❤️ 🐱 🐶 🦄 🚀 🌍",
    "Temperature is 23°C ± 0.5°C; price €12.50 or £10.",
    "E = mc² and ∑ᵢ xᵢ² ≥ 0 for all real x.",
    "Call +1 (555) 010-9999 or email info@example.com.",
    "Visit https://example.org/path?query=1&lang=en#section for details.",
    # Code
    "def add(a, b):\n    return a + b",
    "for (int i = 0; i < n; ++i) { sum += arr[i]; }",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "const greet = (name) => `Hello, ${name}!`;",
    'fn main() { println!("hello {}", 42); }',
    '<div class="card"><p>Hello</p></div>',
    'git commit -m "fix: handle empty input" && git push origin main',
    '{"key": [1, 2, 3], "nested": {"ok": true, "value": null}}',
    "import numpy as np\nx = np.linspace(0, 1, 100)\nprint(x.mean())",
    '#include <stdio.h>\nint main(void) { printf("hi\\n"); return 0; }',
    # Whitespace and punctuation oddities
    "   leading and trailing spaces   ",
    "tabs\tbetween\twords\tand\nnew\nlines",
    "ALL CAPS SENTENCE WITH SHOUTING!!!",
    "mIxEd CaSe WoRdS iN a SeNtEnCe",
    "word-with-hyphens and under_scores and dots.in.between",
    "Numbers: 3.14159, 2,718, 1e-9, 0x1F, 1,000,000.",
    "...?!;:—–-()[]{}«»„“”‘’",
    "Dr. Smith arrived at 5 p.m. on Jan. 3rd, i.e. yesterday.",
]

SHORT = [
    "a",
    "I",
    "ok",
    "yes",
    "no",
    "cat",
    "Hi!",
    "?",
    "42",
    "🙂",
    "猫",
    "кот",
    "ñ",
    "über",
    "x = 1",
    "[SEP]",
    "[CLS] text",
    "<s>",
    "\u00a0",
    "done.",
]


def _long_paragraph(start: int, count: int) -> str:
    # Consecutive sentences from several languages: realistic long inputs that cross the
    # 256-token truncation limit for larger counts.
    n = len(SENTENCES)
    return " ".join(SENTENCES[(start + k * 7) % n] for k in range(count))


@cache
def corpus() -> tuple[str, ...]:
    items: list[str] = list(SENTENCES)
    items += SHORT
    n = len(SENTENCES)
    # Pairs: medium-length inputs mixing two topics/languages.
    items += [f"{SENTENCES[i]} {SENTENCES[(i * 5 + 3) % n]}" for i in range(n)]
    # Long paragraphs: 6..30 sentences (some well past 256 tokens).
    items += [_long_paragraph(i * 3, 6 + (i % 25)) for i in range(60)]
    # Questions built on the sentences (retrieval-style queries).
    items += [f"What does this say: {SENTENCES[i].lower()}" for i in range(n)]
    return tuple(items)


@cache
def late_chunking_documents() -> tuple[tuple[str, ...], ...]:
    """Multi-chunk documents for late chunking: each long paragraph of the corpus as its
    sentences, in order (a chunk keeps the space after it, so the chunks joined are the
    paragraph, character for character)."""
    n = len(SENTENCES)
    docs = []
    for i in range(60):  # the corpus's long paragraphs, as `corpus` builds them
        start, count = i * 3, 6 + (i % 25)
        sentences = [SENTENCES[(start + k * 7) % n] for k in range(count)]
        docs.append(tuple(s + " " for s in sentences[:-1]) + (sentences[-1],))
    return tuple(docs)


def queries() -> list[str]:
    """Short retrieval queries: each paraphrases one base sentence."""
    return [f"Tell me about: {s}" for s in SENTENCES[::2]]


def documents() -> list[str]:
    return list(SENTENCES)


def probe_set() -> list[str]:
    """A small fixed subset for numerical fingerprints."""
    items = corpus()
    return [items[i] for i in range(0, len(items), 13)]
