"""The embedded text the local test model is trained on (see :mod:`mlxq.devkit.make_model`).

Twelve topics, each with word lists and a few hand-written lines; documents are
short paragraphs or one-turn chats that stay on one topic, so a small model
learns to answer "Tell me about the sea." with sentences about the sea.  Some
words are non-ASCII and a few lines carry emoji, so multi-byte tokens occur.
Everything is generated from a seeded :class:`random.Random`: same seed, same text.
"""

from __future__ import annotations

import random

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a friendly assistant. Answer in a few short sentences.",
    "You are a calm assistant who likes simple words.",
)

NAMES = (
    "Anna", "Tom", "Mia", "Leo", "Sara", "Ben", "Zoë", "José", "Renée", "Jürgen",
    "Björn", "Chloé", "Søren", "Yuki", "Kenji", "Amélie", "Noah", "Lena",
)

QUESTIONS = (
    "Tell me about {topic}.",
    "What do you know about {topic}?",
    "Can you describe {topic}?",
    "Say something about {topic}, please.",
    "Write a few sentences about {topic}.",
    "What is {topic} like?",
    "I want to hear about the {noun}.",
)

OPENERS = (
    "Here is something about {topic}.",
    "Sure. {Topic} is a nice thing to talk about.",
    "Of course, {topic}.",
    "Let me tell you about {topic}.",
    "{Topic} is one of my favorite things.",
)

SENTENCES = (
    "The {adj} {noun} {verb}.",
    "The {noun} {verb} {place}.",
    "{Place}, the {noun} {verb}.",
    "Every morning the {noun} {verb}.",
    "We saw a {adj} {noun} {place}.",
    "There is a {adj} {noun} {place}.",
    "The {noun} and the {noun2} are {adj} today.",
    "{name} says that the {noun} is {adj}.",
    "{name} likes the {adj} {noun} very much.",
    "Sometimes the {noun} {verb}, and the {noun2} {verb2}.",
    "At {hour} o'clock the {noun} {verb}.",
    "In the evening the {noun} is {adj} and the {noun2} {verb2}.",
    "I think the {noun} is {adj}.",
    "{name} and {name2} look at the {adj} {noun}.",
    "It was {number} years ago when the {noun} first {past}.",
)

# name, nouns, adjectives, verbs (3rd person), places, past tense, hand-written lines
_TOPICS = {
    "the sea": (
        "wave boat ship gull shell harbor lighthouse tide fish sailor",
        "blue calm wild salty bright deep cold quiet",
        "rolls over the rocks|shines in the sun|moves slowly|sings in the wind"
        "|comes back every day|crashes on the shore|rests in the bay|waits for the tide",
        "near the harbor|along the shore|by the lighthouse|under the pier|on the beach|out at sea",
        "came in with the tide",
        "The sea is bright and blue today 🌊.|Old sailors say the sea never sleeps."
        "|The boats of Saint-Malo rest in the harbor at night.|Gulls cry over the cold grey waves.",
    ),
    "the weather": (
        "rain cloud wind storm sun snow sky fog thunder breeze",
        "grey warm cold windy sunny heavy soft dark",
        "falls all day|moves over the hills|blows from the west|turns the sky grey"
        "|comes back in the afternoon|makes the streets wet|clears in the evening|covers the town",
        "over the hills|above the town|across the valley|outside the window|in the north|over the fields",
        "came from the west",
        "Rain again ☔, so I stay inside with tea.|The forecast says sun tomorrow ☀️."
        "|In Zürich the snow fell all night.|A cold wind blows, and the clouds are low.",
    ),
    "cooking": (
        "soup bread pan oven recipe onion tomato sauce kitchen cake",
        "hot fresh sweet spicy warm golden simple tasty",
        "smells very good|bakes in the oven|cooks on the stove|needs more salt"
        "|is ready at noon|tastes like summer|waits on the table|fills the house with steam",
        "in the kitchen|on the stove|at the market|on the table|in the oven|at home",
        "came out of the oven",
        "We made crème brûlée and a jalapeño salsa 🌶️.|The café sells fresh bread every morning."
        "|Slow soup is the best soup.|Grandma cooks with butter, garlic and love 🍲.",
    ),
    "music": (
        "song piano guitar drum band singer melody violin choir concert",
        "loud soft happy sad old new slow beautiful",
        "plays all night|fills the room|starts very softly|sounds like rain"
        "|gets louder and louder|makes people dance|ends with a long note|echoes in the hall",
        "in the concert hall|on the radio|in the small room|on the stage|in the park|at the festival",
        "played on the radio",
        "Music fills the small room 🎵.|The band plays a song about the night."
        "|In Kraków a violin plays near the old square.|The choir sings, and everyone listens.",
    ),
    "cats and dogs": (
        "cat dog puppy kitten tail ball bowl bed collar bird",
        "small sleepy happy lazy playful hungry soft brave",
        "sleeps on the sofa|runs in the garden|waits by the door|chases the ball"
        "|eats from the bowl|plays all afternoon|looks out the window|barks at the mailman",
        "on the sofa|in the garden|by the door|under the table|near the fire|in the sun",
        "ran into the garden",
        "The cat sleeps on the sofa 🐱.|The dog waits by the door for his walk 🐶."
        "|A kitten is small, soft and very curious.|Cats like warm places and quiet rooms.",
    ),
    "space": (
        "star planet moon rocket comet galaxy orbit astronaut telescope sun",
        "bright distant dark huge silent cold red ancient",
        "shines in the night|moves around the sun|climbs into the sky|glows far away"
        "|turns very slowly|lights up the dark|travels for years|hides behind the moon",
        "in the night sky|beyond the moon|in deep space|near the planet|above the earth|far away",
        "appeared in the sky",
        "The rocket climbs into the dark sky 🚀.|Astronauts see the earth as a small blue ball."
        "|The moon is bright tonight 🌙.|Light from a distant star travels for years.",
    ),
    "the garden": (
        "flower tree rose seed leaf grass bee tomato apple gardener",
        "green tall small fresh yellow red wild sweet",
        "grows in the sun|needs water every day|opens in spring|moves in the wind"
        "|smells sweet|turns red in autumn|grows near the wall|waits for the rain",
        "in the garden|near the wall|by the gate|under the tree|in the greenhouse|along the path",
        "grew in the spring",
        "Tomatoes grow fast in summer 🍅.|The roses open in May 🌹."
        "|A bee visits every flower in the garden.|The old gardener plants seeds in rows.",
    ),
    "trains": (
        "train station ticket platform engine carriage rail conductor passenger track",
        "fast slow long old crowded quiet late modern",
        "leaves at nine|arrives on time|waits at the platform|runs through the night"
        "|crosses the bridge|stops at every station|moves along the river|goes to the city",
        "at the station|on the platform|across the country|over the bridge|through the tunnel|by the river",
        "left the station",
        "The night train to München leaves at nine 🚆.|Trains cross the mountains to São Paulo."
        "|A ticket to the coast costs very little.|The station is crowded in the morning.",
    ),
    "coffee": (
        "coffee cup bean milk café espresso barista mug kettle sugar",
        "hot strong dark sweet fresh bitter warm small",
        "smells wonderful|is ready in a minute|keeps me awake|tastes a little bitter"
        "|waits on the counter|warms my hands|comes from the hills|needs a little milk",
        "at the café|on the counter|in the kitchen|by the window|on the table|at the corner shop",
        "came from the hills",
        "Coffee first ☕, then everything else.|The barista knows my name and my order."
        "|A small café on the corner serves the best espresso.|Dark coffee with a little sugar is nice.",
    ),
    "the mountains": (
        "mountain peak trail rock lake valley forest climber snow cabin",
        "high steep cold quiet green rocky white beautiful",
        "rises above the clouds|stands very still|looks over the valley|holds the snow"
        "|goes up to the peak|shines in the morning|hides in the fog|waits for the climbers",
        "above the valley|on the trail|near the lake|in the forest|at the top|under the peak",
        "rose above the valley",
        "Fuji-san, 富士山, is a famous mountain in Japan 🏔️.|The trail goes up through the forest."
        "|Climbers start early, before the sun.|The lake below the peak is very cold.",
    ),
    "books": (
        "book page story library reader author chapter poem shelf word",
        "old new long short thick quiet favorite strange",
        "sits on the shelf|tells a long story|begins with a letter|ends too soon"
        "|waits in the library|opens a new world|has many pages|stays with the reader",
        "in the library|on the shelf|by the window|in the bag|at the bookshop|under the lamp",
        "was first written",
        "A good book is a quiet friend 📚.|The library opens at ten."
        "|She learned 日本語 from an old book of poems.|Every chapter ends with a question.",
    ),
    "the city": (
        "street bus bridge square market tower park crowd lamp building",
        "busy noisy bright old crowded tall quiet modern",
        "wakes up early|never sleeps|fills with people|shines at night"
        "|grows every year|moves very fast|looks beautiful in the rain|gets quiet after midnight",
        "in the old town|on the main street|near the river|across the square|in the center|by the market",
        "was built",
        "Tokyo, 東京, is bright at night 🌃.|The market square is busy on Saturday."
        "|From the tower you can see the whole city.|Buses and bikes move along the main street.",
    ),
}

TOPICS = {
    name: {
        "nouns": nouns.split(),
        "adjs": adjs.split(),
        "verbs": verbs.split("|"),
        "places": places.split("|"),
        "past": past,
        "lines": lines.split("|"),
    }
    for name, (nouns, adjs, verbs, places, past, lines) in _TOPICS.items()
}

_SYLLABLES = (
    "ka lo mi ra ven tor bel sa nu qui dor fen ash lin mar ze pol tan vi ro gal "
    "sen du ber ko la ri mon fa ul tes cra wen dil ho pra tul "
    "sha nor ki be ta vo el ran ge mus cel pi tha or zu"
).split()


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def sentence(rng: random.Random, topic: str) -> str:
    """One sentence about ``topic``."""
    t = TOPICS[topic]
    noun, noun2 = rng.sample(t["nouns"], 2)
    verb, verb2 = rng.sample(t["verbs"], 2)
    name, name2 = rng.sample(NAMES, 2)
    if rng.random() < 0.15:
        return rng.choice(t["lines"])
    text = rng.choice(SENTENCES).format(
        adj=rng.choice(t["adjs"]), noun=noun, noun2=noun2, verb=verb, verb2=verb2,
        place=rng.choice(t["places"]), Place=_cap(rng.choice(t["places"])),
        name=name, name2=name2, hour=rng.randint(1, 12), number=rng.randint(2, 90),
        past=t["past"],
    )
    return _cap(text)


def paragraph(rng: random.Random, topic: str, n: int) -> str:
    return " ".join(sentence(rng, topic) for _ in range(n))


def chat(rng: random.Random, topic: str) -> list[dict[str, str]]:
    """A one-turn conversation about ``topic`` (with a system prompt half the time)."""
    noun = rng.choice(TOPICS[topic]["nouns"])
    question = rng.choice(QUESTIONS).format(topic=topic, noun=noun)
    opener = rng.choice(OPENERS).format(topic=topic, Topic=_cap(topic))
    answer = opener + " " + paragraph(rng, topic, rng.randint(2, 4))
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.5:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return messages


def documents(seed: int, n: int, chat_fraction: float = 0.5) -> list[str | list[dict[str, str]]]:
    """``n`` documents: plain paragraphs (str) or conversations (message lists)."""
    rng = random.Random(seed)
    topics = list(TOPICS)
    docs: list[str | list[dict[str, str]]] = []
    for _ in range(n):
        topic = rng.choice(topics)
        if rng.random() < chat_fraction:
            docs.append(chat(rng, topic))
        else:
            docs.append(paragraph(rng, topic, rng.randint(3, 6)))
    return docs


def lexicon(seed: int, n: int) -> list[str]:
    """``n`` lines of invented place names and numbers: extra tokenizer-training text
    so a large byte-level BPE vocabulary (~8k) can be filled from this small corpus."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [
            "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
            for _ in range(rng.randint(3, 6))
        ]
        words[0] = _cap(words[0])
        lines.append(" ".join(words) + " %d, %d." % (rng.randint(0, 9999), rng.randint(0, 99)))
    return lines
