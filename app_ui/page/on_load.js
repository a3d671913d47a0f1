// Phones: the settings sidebar starts closed (Gradio opens it at any width). Wide screens: the
// message box has the focus (on a phone that would open the keyboard over the page). The empty
// chat opens at its beginning (Gradio scrolls it to its end: the welcome text cut mid-sentence).
() => {
  const chat = document.querySelector('#chatbot .bubble-wrap');
  const toTop = () => { if (chat && document.querySelector('#chatbot .placeholder-content')) chat.scrollTo(0, 0); };
  [0, 400, 1000].forEach((ms) => setTimeout(toTop, ms));  // after Gradio's own scroll (300 ms after a change)
  chat?.addEventListener('scroll', toTop);  // and Gradio's later ones while the page loads (a busy machine)
  setTimeout(() => chat?.removeEventListener('scroll', toTop), 2000);
  if (window.innerWidth < 768) {
    const sidebar = document.querySelector('.sidebar.open');
    if (sidebar) sidebar.querySelector('.toggle-button').click();
  } else {
    document.querySelector('#chat-input textarea')?.focus({ preventScroll: true });
  }
}
