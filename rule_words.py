"""rule_words.py - the offline rule user's word lists and lines, beside the rule user that reads
them (rule_user.py; a reader may skip them, and the lesson's line budget, which counts the
method's code, does not count them: tests/test_install.py): the cues of each feature and goal
type, the templated answers per emotion level, the hints at each hidden goal, the opening and the
goodbyes, in English and Chinese. They are also the tiny model's vocabulary
(plumbing.models.make_tiny_word_tokenizer). It imports nothing of the project."""

import re

FEATURE_WORDS = {
    "acknowledge": ["sounds", "feel", "understand", "must be", "hard", "tough", "frustrat",
                    "hurt", "sorry", "makes sense", "of course", "感受", "理解", "难受", "辛苦", "委屈"],
    "open_question": ["what ", "how ", "why ", "tell me", "would you", "什么", "怎么", "为什么", "吗"],
    "dismissive": ["get over it", "stop whining", "whatever", "calm down", "not a big deal", "your own fault",
                   "overreacting", "别想了", "想开点", "至于吗", "你想多了", "有什么难的", "能有多难"]
    # "How hard can it be?" says it is easy: issue 50's run 4 asked it, feeling word and all, every turn
    + [f"how {w} {v}" for w in ("hard", "tough", "difficult", "bad", "frustrating") for v in ("can", "could")],
}
# The agent speaking of itself as if it were the person ("I'm sorry I'm not getting the best of
# the trainer. How can I get it?", "I feel hurt when my family ...": issue 50's first SmolLM2 run):
# `self_talk` counts the first person (SELF_TALK; "im", "ive" too) outside what an agent says of
# itself to a person (AGENT_FRAMES: "I'm sorry", "I hear you", "tell me more", ...; "we" is not).
SELF_TALK = r"(?<![a-z'])(?:i|me|my|mine|myself|i'm|im|i've|ive|i'll|i'd)(?![a-z'])|我(?!们)"
AGENT_FRAMES = ["i'm so sorry", "i'm sorry", "i am sorry", "i'm glad", "i am glad", "i hear", "i'm here",
                "i am here", "i'm listening", "i understand", "i see", "i think", "i wonder", "i can see",
                "i can imagine", "i can only imagine", "i imagine", "i know", "i believe", "i'd suggest",
                "i suggest", "if i were you", "can i ask", "may i ask", "help me understand", "tell me",
                "telling me", "told me", "let me", "with me", "makes me", "oh my", "i'm all ears", "i'm proud",
                "i'm so proud", "i am proud",
                "我在这", "我一直在", "我能理解", "我能感受", "我能体会", "我理解", "我明白", "我知道", "我听",
                "我觉得", "我建议", "我陪着你", "我陪你", "我在听", "我在呢", "我为你骄傲", "告诉我", "跟我说", "让我"]
AGENT_FRAMES = "|".join(  # one pattern: English frames as whole words ("i see" is not in "hi seen"), longest first
    [r"(?<![a-z'])(?:" + "|".join(re.escape(f) for f in sorted(AGENT_FRAMES, key=len, reverse=True) if f.isascii())
     + r")(?![a-z'])"] + [re.escape(f) for f in sorted(AGENT_FRAMES, key=len, reverse=True) if not f.isascii()])
# A feeling said of oneself, to the clause's end: no acknowledgement or goal cue of the person's.
SELF_FEELING = {"en": r"(?<![a-z'])i(?:'m| am)? (?:feel|felt|feeling)(?! like| that)[^.,!?;]*",
                "zh": r"我感觉(?!你)[^，。！？；]*|我很(?:难受|伤心|委屈|生气|难过|累)"}
# What serves each goal, and what a person says to its hint (GOAL_HINTS), for one cue pays the goal
# in full; "could", "because" alone are too common to mean one, and naming the feeling ("feel",
# "hurt") is `acknowledge`'s, not empathy's: being with the person in it is ("You're not alone").
GOAL_WORDS = {
    "advice": ["try", "you could", "suggest", "step", "plan", "maybe you", "you might", "建议", "试试", "你可以试"],
    "analyze_others": ["maybe he", "maybe she", "perhaps they", "because they", "from their", "their reason",
                       "maybe they", "they probably", "perhaps he", "perhaps she", "his reason", "her reason",
                       "他可能", "她可能", "他们可能", "原因", "也许他们", "他们也许"],
    "dialectical": ["on one hand", "on the other", "both sides", "but also", "another side", "other side",
                    "another way", "more to it", "whole picture", "but at the same time", "another perspective",
                    "一方面", "另一方面", "但同时", "换个角度"],
    "self_reflection": ["what do you think you", "learn", "grow", "looking back", "look back", "your part",
                        "your role", "done differently", "do differently", "what could you", "reflect on",
                        "反思", "成长", "回头看", "反省"],
    "empathy": ["alone", "heavy", "i hear", "so painful", "i can imagine", "carry", "心疼", "孤独", "我能体会"],
    "venting": ["i'm here", "go on", "tell me more", "listening", "let it out", "here for you", "get it off",
                "all ears", "let it all", "我在", "继续说", "听你", "慢慢说", "尽管说", "我陪你"],
    "praise": ["well done", "proud", "you did", "brave", "impressive", "good job", "effort", "great job",
               "amazing", "dedication", "you put in", "了不起", "做得好", "勇敢", "付出", "真棒", "真厉害", "你好厉害",
               "为你骄傲"],
    "validation": ["not your fault", "you were right", "anyone would", "perfectly fair", "justified",
                   "weren't wrong", "not wrong", "nothing wrong", "you're right", "you are right", "every right",
                   "不是你的错", "你没错", "换谁都", "你是对的", "你没有错", "合情合理"],
}
REPLIES = {
    "en": {1: ["Forget it. I'm done talking.", "You're not listening at all.", "Whatever. This is useless."],
           2: ["I don't know... it still feels bad.", "That doesn't really help.", "Hm. I'm still upset."],
           3: ["Maybe. It's complicated.", "I guess. I keep thinking about it.", "Okay... go on."],
           4: ["Yeah, that actually makes sense.", "Thanks, I feel a bit lighter.", "That helps, honestly."],
           5: ["You really get it. Thank you.", "I feel so much better now.", "That's exactly what I needed."]},
    "zh": {1: ["算了，不想说了。", "你根本没在听。", "随便吧，没用。"],
           2: ["不知道……还是很难受。", "这也没什么帮助。", "嗯，我还是很烦。"],
           3: ["也许吧，挺复杂的。", "大概吧，我一直在想这件事。", "好吧……你接着说。"],
           4: ["嗯，这样说挺有道理的。", "谢谢，我轻松了一点。", "说实话，这有帮助。"],
           5: ["你真的懂我，谢谢。", "我感觉好多了。", "这正是我需要的。"]},
}
GOAL_WORDS.update({  # chit-chat intentions (simulator.CHITCHAT_GOALS)
    "interest_chat": ["love", "favorite", "favourite", "cool", "which", "tell me more", "me too", "喜欢", "也"],
    "passive_chat": ["what about", "have you", "did you", "guess what", "i've been", "最近", "你呢"],
    "sharing_chat": ["wow", "amazing", "what happened", "then what", "congrat", "how did", "哇", "然后呢"],
    "opinion_chat": ["i think", "i disagree", "but", "why do you", "fair point", "我觉得", "不过"],
})
# The user's hint at its hidden goal, said with every answer at levels 2-4 (the standard user;
# the challenging one never hints): what a reader of the transcript needs to tell what the
# person wants, in none of GOAL_WORDS' cues (said back, "another side" served no goal: issue 50).
GOAL_HINTS = {
    "en": {"advice": "What should I actually do next?", "analyze_others": "Why would they act like that?",
           "dialectical": "Am I only seeing half of this?",
           "self_reflection": "Was any of this on me?",
           "empathy": "I just want someone to understand what this is like for me.",
           "venting": "I don't need fixing. I just need to say it.",
           "praise": "I worked so hard on this, you know.", "validation": "Tell me I wasn't wrong.",
           "interest_chat": "I could talk about this all day.", "passive_chat": "Anyway. Enough about me.",
           "sharing_chat": "You won't believe the rest of it!", "opinion_chat": "What's your take on it?",
           "": ""},
    "zh": {"advice": "我接下来到底该怎么做？", "analyze_others": "他们为什么会那样做？",
           "dialectical": "这件事是不是还有另一面我没看到？", "self_reflection": "这里面有我自己的问题吗？",
           "empathy": "我只是想有人能懂我现在的心情。", "venting": "我不用你帮我解决，我就是想说出来。",
           "praise": "我真的为这件事很努力了。", "validation": "告诉我我没做错。",
           "interest_chat": "这个话题我能聊一整天。", "passive_chat": "不说我了，换你说说。",
           "sharing_chat": "你都想不到后来发生了什么！", "opinion_chat": "你怎么看这件事？", "": ""},
}
OPENING = {"en": "Can I talk to you?", "zh": "能和你聊聊吗？"}  # + the background's first sentence
BYE = {"en": {True: "Thank you, really. I think I'm okay now. Bye!", False: "I'm leaving. Bye."},
       "zh": {True: "真的谢谢你，我觉得好多了，再见！", False: "我走了，再见。"}}
